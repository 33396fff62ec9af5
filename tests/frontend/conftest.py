"""Tests of the engine-neutral OpenAI front end (``src/dualpath/frontend``): no engine runs."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
