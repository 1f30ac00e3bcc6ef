"""Errors that are the user's to fix (configuration, data layout), reported without a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration or data problem the user can fix; ``train.py`` prints only its message."""


class DataNotFoundError(ConfigError):
    """A dataset is missing or not laid out as expected.

    Args:
        dataset: What was looked for, e.g. ``"ImageNet-style (ImageFolder) data"``.
        path: The path that was checked.
        layout: The directory layout the datamodule expects.
        setting: The config key that sets the path, e.g. ``"data.root"``.
    """

    def __init__(self, dataset: str, path: str, layout: str, setting: str = "data.root") -> None:
        self.dataset = dataset
        self.path = path
        self.layout = layout
        self.setting = setting
        super().__init__(self.describe())

    def describe(self, recipe: str | None = None) -> str:
        """The message, naming ``recipe`` (and how to run it without data) when given."""
        who = f"recipe '{recipe}' needs" if recipe else "needs"
        lines = [
            f"{who} {self.dataset}, but found none at {self.path}",
            f"  expected layout: {self.layout}",
            f"  point {self.setting}=/path/to/data at it",
        ]
        if recipe:
            lines.append(f"  or try the recipe without data: python train.py recipe={recipe} data=synthetic")
        else:
            lines.append("  or use synthetic data (SyntheticDataModule / data=synthetic)")
        return "\n".join(lines)
