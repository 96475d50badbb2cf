"""media: bytes by content address (the image store, the blob store) and image checks.

:mod:`tapioca.media.store` keeps encoded image bytes under their SHA-256 (a directory,
or an object store by URL), and is the run's one content-addressed store: MoE routes
too large for an event go to its ``<run dir>/blobs``; :mod:`tapioca.media.images`
checks bytes and turns them into the :class:`~tapioca.schemas.events.ImageRef` that
events carry. No Kafka, no model.
"""
