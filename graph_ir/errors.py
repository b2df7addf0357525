"""The one exception type for mistakes a user can fix (bad YAML, impossible cluster shape, model too big).

The CLI prints its message and exits with code 2, without a traceback. Everything else is a bug
and keeps its traceback. It lives in graph_ir, the lowest layer, so every layer can raise it.
"""


class UserError(Exception):
    exit_code = 2
