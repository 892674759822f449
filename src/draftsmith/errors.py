"""User-facing errors: each one names the problem and how to fix it."""


class DraftsmithError(Exception):
    """An error the user can fix. The CLI and stage scripts print it without a traceback."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")


class ConfigError(DraftsmithError):
    """params.yaml is invalid (unknown key, wrong type, impossible value, missing file)."""
