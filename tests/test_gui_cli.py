"""main.py: bad arguments give one clear line and exit 2; headless mode and --screenshot run to the end."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_main(*args, timeout=90):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_missing_checkpoint_is_one_line_and_exit_2(tmp_path):
    for extra in ((), ("--headless",)):
        result = run_main("--model", str(tmp_path / "no-such-checkpoint"), *extra)
        assert result.returncode == 2
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in result.stderr


def test_invalid_block_size_exits_2():
    result = run_main("--block-size", "0", "--headless")
    assert result.returncode == 2 and "block_size" in result.stderr and "Traceback" not in result.stderr


def test_headless_busy_demo_runs_until_idle():
    result = run_main("--headless", "--demo", "busy", "--num-blocks", "64", "--block-size", "4")
    assert result.returncode == 0, result.stderr
    assert "idle after" in result.stdout and "finished" in result.stdout


def test_headless_with_compiled_attention_runs_until_idle():
    result = run_main("--headless", "--demo", "busy", "--num-blocks", "64", "--block-size", "4",
                      "--compile-attention", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "idle after" in result.stdout and "finished" in result.stdout
    assert "eager path" not in result.stderr  # the compiled kernel did not fall back


def test_screenshot_is_saved(tmp_path):
    from PySide6 import QtGui
    path = tmp_path / "shot.png"
    result = run_main("--demo", "busy", "--num-blocks", "64", "--block-size", "4", "--screenshot", str(path),
                      "--quit-after", "1.5")
    assert result.returncode == 0, result.stderr
    image = QtGui.QImage(str(path))
    assert not image.isNull() and image.width() >= 1000
