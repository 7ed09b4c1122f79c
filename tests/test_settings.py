"""Each setting is declared once, as a field of `LoaderConfig`; the Loader's signature and its
documented arguments follow it, and a test says where they drift."""

from __future__ import annotations

import dataclasses
import inspect
import re

import aioloader
from aioloader._config import LoaderConfig

DERIVED = {"auto_concurrency", "has_executor"}
"""Fields the Loader derives from its arguments (`concurrency="auto"`, `executor=`)."""
NOT_SETTINGS = {"executor"}
"""An argument that is not configuration: the executor stays the caller's, in this process."""


def _parameters() -> dict[str, inspect.Parameter]:
    parameters = dict(inspect.signature(aioloader.Loader.__init__).parameters)
    del parameters["self"]
    return parameters


def test_every_setting_is_a_config_field_and_a_loader_argument() -> None:
    fields = {field.name for field in dataclasses.fields(LoaderConfig)} - DERIVED
    assert set(_parameters()) - NOT_SETTINGS == fields


def test_every_argument_is_documented_in_the_loaders_docstring() -> None:
    doc = aioloader.Loader.__doc__ or ""
    args = doc.split("Args:", 1)[1]
    documented = {name.strip() for line in re.findall(r"^ {8}([a-z_, ]+):", args, re.M)
                  for name in line.split(",")}
    assert set(_parameters()) == documented


def test_the_dataset_and_decode_come_by_position_everything_else_by_keyword() -> None:
    """`Loader(ds, 64)` read as DataLoader's batch size would silently be a decode."""
    kinds = {name: p.kind for name, p in _parameters().items()}
    assert [name for name, kind in kinds.items()
            if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == ["dataset", "decode"]
    assert all(kind is inspect.Parameter.KEYWORD_ONLY
               for name, kind in kinds.items() if name not in ("dataset", "decode"))
