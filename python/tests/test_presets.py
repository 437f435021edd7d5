"""Presets by name with keyword overrides mapped onto the C++ preset's fields."""

import copy

import pytest

import kvpolicy

ALL = [kvpolicy.Zipage, kvpolicy.RKV, kvpolicy.GKV, kvpolicy.SnapKV, kvpolicy.H2O, kvpolicy.StreamingLLM,
       kvpolicy.HardKV, kvpolicy.HardKVRKV, kvpolicy.Kara]


def test_defaults_are_the_published_parameters():
    z = kvpolicy.Zipage()
    assert (z.window, z.protect_window, z.group, z.reduce, z.alpha, z.kernel, z.first_only, z.tau, z.lambda_) == (
        16, 16, "max", "mean", 0.8, 5, True, 0.4, 0.2)
    r = kvpolicy.RKV()
    assert (r.window, r.group, r.keys_before_window, r.kernel, r.tau, r.lambda_) == (8, "max_logits", True, 7, 1.0, 0.1)
    g = kvpolicy.GKV()
    assert (g.window, g.alpha, g.max_norm, g.lambda_) == (16, 0.8, True, 0.5)
    s = kvpolicy.SnapKV()
    assert (s.window, s.group, s.reduce, s.kernel) == (32, "mean", "sum", 7)
    assert kvpolicy.H2O().reduce == "sum"
    assert (kvpolicy.StreamingLLM().sinks, kvpolicy.StreamingLLM().window) == (4, 16)
    k = kvpolicy.Kara()
    assert (k.window, k.buffer, k.group, k.gamma, k.alpha, kvpolicy.Kara.kara_budget) == (768, 32, "sum", 8, 16, 225)


def test_every_preset_by_name():
    assert list(kvpolicy.PRESETS) == ["zipage", "rkv", "gkv", "snapkv", "h2o", "streaming_llm", "hard_kv",
                                      "hard_kv_rkv", "kara"]
    for name, cls in kvpolicy.PRESETS.items():
        assert cls.name == name and kvpolicy.preset(name) == cls()


def test_keywords_override_fields():
    z = kvpolicy.Zipage(window=8, alpha=0.9)
    assert (z.window, z.protect_window, z.alpha) == (8, 8, 0.9)
    # The specific keyword wins over the general one, whatever their order.
    assert kvpolicy.Zipage(protect_window=4, window=8).protect_window == 4
    z.kernel = 3
    assert z.kernel == 3 and kvpolicy.Zipage().kernel == 5


@pytest.mark.parametrize("cls", ALL)
def test_params_round_trip(cls):
    p = cls()
    assert cls(**p.params()) == p
    assert kvpolicy.preset(cls.name, **p.params()) == p
    assert eval(repr(p), {cls.__name__: cls}) == p
    assert copy.deepcopy(p) == p


@pytest.mark.parametrize("cls", ALL)
def test_unknown_keyword_is_a_type_error_naming_it(cls):
    with pytest.raises(TypeError, match="'windw'"):
        cls(windw=8)


def test_bad_values_name_the_keyword():
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.SnapKV(group="median")
    assert e.value.field == "group" and "'median'" in str(e.value)
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.Zipage(window=2.5)
    assert e.value.field == "window"
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.Zipage(window=2**40)
    assert e.value.field == "window"
    with pytest.raises(kvpolicy.Error) as e:
        kvpolicy.preset("zippage")
    assert e.value.field == "preset"
    assert isinstance(e.value, ValueError)


def test_h2o_and_streaming_llm_have_only_their_own_keywords():
    with pytest.raises(TypeError, match="'alpha'"):
        kvpolicy.H2O(alpha=0.5)
    s = kvpolicy.StreamingLLM(sinks=2, window=8)
    assert (s.sinks, s.window) == (2, 8)
