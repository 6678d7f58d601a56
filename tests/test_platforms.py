"""Platform defaults and the Neuron compiler environment, without the Neuron toolchain."""

from __future__ import annotations

import pytest

from jdeep import platforms


def test_platform_defaults():
    assert platforms.platform_for("cpu").fp8_max == 448 and platforms.platform_for("cpu").compile_mode == "scan"
    assert platforms.platform_for("cuda").name == "gpu"
    trn2 = platforms.platform_for("neuron", "trn2")
    assert (trn2.fp8_max, trn2.compile_mode, trn2.host_loop) == (240, "regions", True)
    assert platforms.platform_for("neuron", "trn3").fp8_max == 448
    assert platforms.current().name == "cpu"


def test_neuron_generation_from_env_and_instance_type():
    assert platforms.neuron_generation({"NEURON_PLATFORM_TARGET_OVERRIDE": "gen3"}, "") == "trn2"
    assert platforms.neuron_generation({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn3"}, "trn2.48xlarge") == "trn3"
    assert platforms.neuron_generation({}, "trn1.32xlarge\n") == "trn1"
    assert platforms.neuron_generation({}, "inf2.xlarge") == "trn1"
    assert platforms.neuron_generation({}, "m7i.large") == "trn2"


def test_configure_neuron_adds_flags_and_keeps_the_users():
    env = {"NEURON_CC_FLAGS": "-O1 --cache_dir=/mine"}
    changed = platforms.configure_neuron(env, generation="trn2")
    flags = env["NEURON_CC_FLAGS"].split()
    assert flags[:2] == ["-O1", "--cache_dir=/mine"] and platforms.FP8_REINTERPRET_FLAG in flags
    assert sum(f.startswith("--cache_dir") for f in flags) == 1
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and set(changed) == {"NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG"}
    assert platforms.configure_neuron(env, generation="trn2") == {}          # idempotent
    trn3 = {}
    platforms.configure_neuron(trn3, generation="trn3", cache_dir="/c")
    assert platforms.FP8_REINTERPRET_FLAG not in trn3["NEURON_CC_FLAGS"] and "--cache_dir=/c" in trn3["NEURON_CC_FLAGS"]


def test_compile_mode_choice(monkeypatch):
    cpu, neuron = platforms.platform_for("cpu"), platforms.platform_for("neuron")
    monkeypatch.delenv("JDEEP_COMPILE_MODE", raising=False)
    assert platforms.compile_mode(None, cpu) == "scan" and platforms.compile_mode(None, neuron) == "regions"
    monkeypatch.setenv("JDEEP_COMPILE_MODE", "regions")
    assert platforms.compile_mode(None, cpu) == "regions" and platforms.compile_mode("scan", cpu) == "scan"
    monkeypatch.setenv("JDEEP_COMPILE_MODE", "layers")
    with pytest.raises(ValueError, match="JDEEP_COMPILE_MODE"):
        platforms.compile_mode(None, cpu)
    with pytest.raises(ValueError, match="compile_mode"):
        platforms.compile_mode("unrolled", cpu)
