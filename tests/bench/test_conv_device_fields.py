"""bench/convolution/conv_device_fields.py: each field of the device description is changed alone, and the
survey counts the calls whose first plan moves and, with measurements, those it explains."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "convolution" / "conv_device_fields.py"
_spec = importlib.util.spec_from_file_location("conv_device_fields", SCRIPT)
fields = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fields)


def test_a_float_scales_a_field_and_an_int_replaces_it():
    base = {"multiProcessorCount": 132, "pciDeviceId": 0, "l2CacheSize": 52428800}
    out = fields.variant(base, {"multiProcessorCount": 0.5, "pciDeviceId": 0x2335})
    assert out == {"multiProcessorCount": 66, "pciDeviceId": 0x2335, "l2CacheSize": 52428800}
    assert base["multiProcessorCount"] == 132  # the catalogue's description is left alone


def test_the_survey_reports_every_description_and_what_the_first_plan_explains(
        deviceless_cudnn):
    cw = fields.cw
    the_shape = {"x": [8, 120, 64, 64], "w": [179, 120, 3, 3], "y": [8, 179, 64, 64], "g": 1,
                 "b": 4, "s": [1, 1], "p": [1, 1]}
    from xmem_admission.contract.cudnn import ConvCall
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator import cudnn_heuristics as ch

    conv = cw.convolution(the_shape)
    first = {c: ch.torch_workspaces(lookup("H200"), conv, ConvCall(c),
                                    library=deviceless_cudnn)[0] for c in cw.CALLS}
    held = cw.held_by_measurement(the_shape, first)
    held["bwd_filter"] = [held["bwd_filter"][0] + 2**20] * 2  # no plan's
    table, summary = fields.survey([{"shape": the_shape, "held_bytes": held}], "H200",
                                   deviceless_cudnn, measured=True)
    described = summary["descriptions"]
    assert set(described) == {"the catalogue's", "heuristics mode B, the catalogue's",
                              *fields.VARIANTS}
    assert described["the catalogue's"]["changed"] == 0
    assert described["the catalogue's"]["explained"] == {"fwd": 1, "bwd_data": 1,
                                                         "bwd_filter": 0}
    assert "| SM count / 2 |" in table and summary["calls"] == 3


def test_a_libcudnn_that_is_not_there_is_a_clear_error():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cudnn", "/nonexistent/libcudnn.so.9",
                           "--shapes", str(ROOT / "bench" / "data" / "conv_shapes.jsonl")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "cannot load cuDNN from /nonexistent" in proc.stderr
