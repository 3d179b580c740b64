"""The engine's error class, in a module of its own so that engine.py and parallel.py both import it from here and
neither imports the other for it (engine.py starts parallel.py's workers; parallel.py raises what engine.py raises)."""


class EngineError(RuntimeError):
    """A request the engine cannot serve, or an engine that cannot make progress."""
