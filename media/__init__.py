"""media: images by content address (the image store) and their checks.

:mod:`tapioca.media.store` keeps encoded image bytes under their SHA-256 (a directory,
or an object store by URL); :mod:`tapioca.media.images` checks bytes and turns them
into the :class:`~tapioca.schemas.events.ImageRef` that events carry. No Kafka, no model.
"""
