"""The error type every user-facing failure of the project derives from."""


class RudaError(Exception):
    """A problem with the user's input or files, with a message that says what to do."""
