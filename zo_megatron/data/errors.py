"""The one exception type of the data layer.

Every problem a user can cause (a missing file, a corrupt index, a vocabulary that does not match)
is raised as a DataError whose message is one line that names the file and says how to fix it.
The CLI prints that line and exits with status 2; the training job can do the same.
"""


from zo_megatron.errors import UserError


class DataError(UserError):
    """A user-fixable problem with input data, a dataset prefix or a tokenizer file."""

    def __init__(self, message: str) -> None:
        # One line, always: a message is printed as `error: <message>` by the CLIs.
        super().__init__(" ".join(str(message).split()))
