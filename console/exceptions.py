class Conflict(Exception):
    """The request is valid but clashes with existing state (a duplicate job, an artifact in use).

    `link` points at what it clashes with, so the UI and API can say where to look."""

    def __init__(self, message: str, *, link: str | None = None, object_id=None):
        super().__init__(message)
        self.message = message
        self.link = link
        self.object_id = object_id


class ServiceUnavailable(Exception):
    """A dependency (Redis, the engine) is down: the request may succeed later."""
