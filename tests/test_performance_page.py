"""docs/performance.md and its Chinese twin are generated from the committed records: they say what the records say.

Plain Python (no torch): the generator reads JSON and writes Markdown.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("performance_page", ROOT / "benchmarks" / "performance_page.py")
page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(page)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_committed_page_equals_what_the_records_give(lang):
    committed = (ROOT / page.PAGES[lang]).read_text()
    assert committed == page.render(lang), (
        f"{page.PAGES[lang]} is not what the records give: run python benchmarks/performance_page.py")


def _layer_record(time_us: float, peer_us: float) -> dict:
    shape = {"batch": 3}
    return {"command": "fnattn bench decode --batch 3", "environment": {"commit": "abcdef0123", "device": "GPU X",
                                                                        "time": "2030-01-02T03:04:05"},
            "records": [{"case": "decode B3", "backend": "peer kernel", "peer": "peer kernel", "shape": shape,
                         "time_us": peer_us},
                        {"case": "decode B3", "backend": "fnattn triton", "peer": "peer kernel", "shape": shape,
                         "time_us": time_us, "ratio_to_peer": peer_us / time_us}]}


def _root(tmp_path: Path, time_us: float) -> Path:
    for folder in (page.RESULTS, page.GPU_RESULTS, "benchmarks"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    for lang in ("en", "zh"):
        shutil.copy(ROOT / page.NOTES[lang], tmp_path / page.NOTES[lang])
    (tmp_path / page.RESULTS / "bench_decode.json").write_text(json.dumps(_layer_record(time_us, 30.0)))
    suite = {"command": "python benchmarks/gpu_pytest_record.py OUT.json -- tests/gpu/test_x_gpu.py -k fast",
             "commit": "1234567890", "time": "2030-01-02T03:04:05", "device": "GPU X", "exit_code": 0,
             "passed": 7, "failed": 1, "skipped": 2, "cases": []}
    (tmp_path / page.GPU_RESULTS / "x_gpu.json").write_text(json.dumps(suite))
    return tmp_path


def test_page_figures_come_from_the_records(tmp_path):
    root = _root(tmp_path, time_us=20.0)
    text = page.render("en", root)
    # 30 us peer over 20 us ours: 1.50x, in the summary and the layer's table, with the record's commit.
    assert "| decode B3 | fnattn triton | 20.0 us | peer kernel | 1.50x |" in text
    assert "abcdef0" in text and "`fnattn bench decode --batch 3`" in text
    assert "| test_x_gpu.py | -k fast | 1234567 | 7 | 1 | 2 | tests |" in text

    (root / page.RESULTS / "bench_decode.json").write_text(json.dumps(_layer_record(60.0, 30.0)))
    slower = page.render("en", root)
    assert "| decode B3 | fnattn triton | 60.0 us | peer kernel | 0.50x |" in slower
    assert "20.0 us" not in slower


def test_check_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    root = _root(tmp_path, time_us=20.0)
    (root / "docs").mkdir()
    monkeypatch.setattr(page, "ROOT", root)
    assert page.main([]) == 0  # writes both pages
    assert page.main(["--check"]) == 0
    (root / page.RESULTS / "bench_decode.json").write_text(json.dumps(_layer_record(60.0, 30.0)))
    assert page.main(["--check"]) == 1
    assert "docs/performance.md" in capsys.readouterr().err


def test_a_layers_record_gives_each_kind_s_time_against_its_floor():
    """A ``fnattn eager layers`` record becomes one row per layer kind (times and floors summed over its layers)
    and one for the rest of the step, whose floor is its weights at the layers' bandwidth."""
    def layer(kind, us, floor, nbytes):
        return {"kind": kind, "time_us": us, "floor_us": floor, "bytes": {"weights": nbytes, "kv_read": 0}}

    rec = {"layers": [layer("gdn", 30.0, 10.0, 1000), layer("gdn", 40.0, 10.0, 1000), layer("full", 9.0, 3.0, 300)],
           "outside_us": 60.0, "outside_weight_bytes": 4000}
    rows = page._layer_rows("m B1 ctx8", rec, page.TEXT["en"])
    assert rows == [["m B1 ctx8", "2 gdn", "70.0 us", "20.0 us", page.x(3.5)],
                    ["m B1 ctx8", "1 full", "9.0 us", "3.0 us", page.x(3.0)],
                    ["m B1 ctx8", "outside the layers", "60.0 us", "40.0 us", page.x(1.5)]]
