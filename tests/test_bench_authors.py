"""bench.authors_step without the authors' code: a missing checkout is a clear error."""

import pytest

from bench import authors_step


def test_missing_checkout_names_path_and_file(tmp_path):
  with pytest.raises(FileNotFoundError) as err:
    authors_step.load_authors(tmp_path / "nowhere")
  message = str(err.value)
  assert str(tmp_path / "nowhere") in message
  assert "optimizers/ginger.py" in message
  assert authors_step.AUTHORS_URL in message


def test_cli_error_before_any_work(tmp_path, capsys):
  with pytest.raises(SystemExit) as err:
    authors_step.main(["--authors", str(tmp_path)])
  assert err.value.code == 2  # argparse's usage error, nothing compiled or timed
  assert "optimizers/ginger.py" in capsys.readouterr().err


def test_bad_counts_are_refused(tmp_path, capsys):
  with pytest.raises(SystemExit):
    authors_step.main(["--authors", str(tmp_path), "--scan", "0"])
  assert "--scan" in capsys.readouterr().err
