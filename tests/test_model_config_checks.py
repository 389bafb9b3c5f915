"""Every family's adapter refuses config.json values of the wrong type or range, naming the field.

One shared check (`models.common.check_config_value`) sits behind all of them:
ints are ints (not bools, not floats) and in range, floats are finite,
``rope_theta > 0`` and ``rms_norm_eps >= 0`` (transformers accepts 0).
"""

from __future__ import annotations

import copy
import math

import pytest
from fnattn.models.common import check_config_value
from fnattn.models.registry import family_named

FAMILIES = ["qwen3_5", "qwen3_next", "deepseek_v3", "deepseek_v32", "glm5", "kimi_linear", "llama", "qwen3", "qwen2"]
NO_ROPE = {"kimi_linear"}  # its MLA layers have no rotary embedding

BAD = {
    "hidden_size": [0, -64, 64.0, "64", True, math.nan],
    "vocab_size": [0, 1e9, None],
    "num_attention_heads": [0, 4.5, False],
    "num_hidden_layers": [-1, "2"],
    "rms_norm_eps": [-1e-6, math.nan, math.inf, "1e-6", True],
    "rope_theta": [0, -10000.0, math.nan, math.inf, -math.inf, "10000", True],
}
CASES = [(fam, name, value) for fam in FAMILIES for name, values in BAD.items() for value in values
         if not (name == "rope_theta" and fam in NO_ROPE)]


def with_value(raw: dict, name: str, value) -> dict:
    """``raw`` with ``name`` set where the family reads it (rope_theta inside ``rope_parameters`` when present)."""
    raw = copy.deepcopy(raw)
    if name == "rope_theta" and isinstance(raw.get("rope_parameters"), dict):
        raw["rope_parameters"]["rope_theta"] = value
    else:
        raw[name] = value
    return raw


@pytest.mark.parametrize("family, name, value", CASES, ids=[f"{f}-{n}-{v!r}" for f, n, v in CASES])
def test_bad_value_is_a_value_error_naming_the_field(family, name, value):
    fam = family_named(family)
    with pytest.raises(ValueError, match=f"{name}` must be") as e:
        fam.adapt(with_value(fam.tiny_config(), name, value))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in NO_ROPE])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_top_level_rope_theta_is_checked_too(family, value):
    fam = family_named(family)
    raw = {k: v for k, v in fam.tiny_config().items() if k != "rope_parameters"}
    with pytest.raises(ValueError, match="`rope_theta` must be a finite number > 0"):
        fam.adapt({**raw, "rope_theta": value})


@pytest.mark.parametrize("family", FAMILIES)
def test_good_values_still_adapt(family):
    fam = family_named(family)
    raw = fam.tiny_config()
    fam.adapt(raw)
    fam.adapt(with_value(raw, "rms_norm_eps", 0))  # transformers accepts eps = 0; so do we (as a float)
    if family not in NO_ROPE:
        assert fam.adapt(with_value(raw, "rope_theta", 500000)) is not None  # an int where a float is asked


def test_shared_check():
    assert check_config_value("w", "x", 3, float) == 3.0 and isinstance(check_config_value("w", "x", 3, float), float)
    assert check_config_value("w", "x", True, bool) is True
    for value, kind, kw, want in [
        (True, int, {}, "an int"),
        (2.0, int, {}, "an int"),
        (0, int, dict(minimum=1), "an int >= 1"),
        (math.nan, float, {}, "a finite number"),
        (0.0, float, dict(above=0), "a finite number > 0"),
        (1, bool, {}, "true or false"),
    ]:
        with pytest.raises(ValueError, match=f"^w: `x` must be {want}, got"):
            check_config_value("w", "x", value, kind, **kw)
