"""Model-free unit tier: string options -> typed values (`config.parse_value`, `EngineConfig.from_strings`),
for every annotation style the option dataclasses use (`X | None` is how an option says "may be unset")."""

from __future__ import annotations

import pytest

from ouro_backend.config import ConfigError, EngineConfig, parse_value


@pytest.mark.parametrize(
    "raw, type_name, want",
    [
        ("7", "int", 7),
        ("7", "int | None", 7),
        ("", "int | None", None),
        ("none", "float | None", None),
        ("null", "Optional[int]", None),
        ("0.5", "float", 0.5),
        ("yes", "bool | None", True),
        ("off", "bool", False),
        ("1, 2 3", "list[int] | None", [1, 2, 3]),
    ],
)
def test_parse_value(raw, type_name, want):
    assert parse_value("x", raw, type_name) == want


def test_parse_value_refuses_what_it_cannot_read():
    with pytest.raises(ConfigError, match="engine option x needs a value"):
        parse_value("x", "", "int")
    with pytest.raises(ConfigError, match=r"x='ten' is not a valid int$"):
        parse_value("x", "ten", "int | None")


def test_from_strings_unset_optional_fields():
    cfg = EngineConfig.from_strings({"enable_prefix_caching": "", "max_model_len": "none", "max_num_seqs": "8"})
    assert cfg.enable_prefix_caching is None and cfg.prefix_caching is True
    assert cfg.max_model_len is None and cfg.max_num_seqs == 8
