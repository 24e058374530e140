"""The one exception type for expected, user-facing errors.

Anything the user can fix (a missing file, a malformed field, an infeasible
budget, an unknown solver) is raised as :class:`MemschedError` with a single
line that names what is wrong and how to fix it. The command line prints that
line and exits with status 2; any other exception is a bug.
"""


class MemschedError(Exception):
    """An expected error whose message is one line: what is wrong, and the fix."""
