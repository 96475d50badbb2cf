"""runtime: what turns a loaded config into running roles.

- :mod:`tapioca.runtime.run`: :func:`~tapioca.runtime.run.resolve_run`, the one place a
  loaded (frozen) config changes: run directory, trial name, the tiny model's path,
  bus run id, signing key path, bootstrap, proxy endpoint.
- :mod:`tapioca.runtime.builders`: the one module that builds every role's objects
  (engines and weights loaders, the trainer's actor, critic, reference and teacher,
  the feeder's records, the scorer's reward function, the proxy's service).

It sits above the roles (producers/, consumers/, trainers/, agents/) and the libraries
they use (engines/, models/, tasks/, algorithms/), and below ops/ (the CLI and the
launchers), which call it. Nothing below imports it.
"""
