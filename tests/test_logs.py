"""training.logs.Progress: without a terminal, periodic train lines with step rate and ETA."""

import re

from training import logs
from training.logs import Progress, format_duration


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def plain(total=1000, initial=0, interval_s=30.0):
  clock = FakeClock()
  return Progress(total, initial, interval_s=interval_s, tty=False, clock=clock), clock


def test_first_update_prints_a_line_without_a_rate(capsys):
  progress, _ = plain()
  progress.update(50, loss=4.25)
  out = capsys.readouterr().out
  assert out == "train step 50/1000 (5.0%) loss=4.25\n"  # its interval includes compiling


def test_periodic_lines_with_steps_per_second_and_eta(capsys):
  progress, clock = plain(interval_s=30.0)
  progress.update(50, loss=4.0)
  clock.now += 10.0
  progress.update(100, loss=3.9)  # too soon: no line
  clock.now += 20.0
  progress.update(150, loss=3.8)  # 100 steps in 30 s since the last line
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2
  assert lines[1] == "train step 150/1000 (15.0%) loss=3.8 | 3.33 steps/s | ETA 0:04:15"


def test_rate_follows_the_current_speed(capsys):
  progress, clock = plain(total=10_000, interval_s=1.0)
  progress.update(0)
  clock.now += 10.0
  progress.update(100)  # 10 steps/s
  clock.now += 10.0
  progress.update(150)  # slowed to 5 steps/s
  lines = capsys.readouterr().out.splitlines()
  assert "| 10 steps/s |" in lines[1]
  assert re.search(r"\| 5 steps/s \| ETA 0:32:50$", lines[2]), lines[2]


def test_last_step_always_prints(capsys):
  progress, clock = plain(total=200)
  progress.update(100, loss=1.0)
  clock.now += 1.0
  progress.update(200, loss=0.5)
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == "train step 200/200 (100.0%) loss=0.5 | 100 steps/s | ETA 0:00:00"


def test_due_says_when_a_line_is_wanted():
  progress, clock = plain(interval_s=30.0)
  assert progress.due()
  progress.update(10)
  assert not progress.due()
  clock.now += 30.0
  assert progress.due()


def test_terminal_gets_the_bar_and_no_plain_lines(capsys):
  progress = Progress(100, 0, tty=True)
  assert not progress.due()
  progress.update(10, loss=2.0)
  progress.close()
  assert "train step" not in capsys.readouterr().out


def test_format_duration():
  assert format_duration(0) == "0:00:00"
  assert format_duration(3725.4) == "1:02:05"
  assert format_duration(2 * 86400 + 61) == "2d 0:01:01"


def test_git_commit_env_override_for_snapshots_without_git(monkeypatch):
  monkeypatch.setenv("GINGER_GIT_COMMIT", "0123abc")
  assert logs.git_commit() == "0123abc"
  monkeypatch.delenv("GINGER_GIT_COMMIT")
  assert logs.git_commit() != "0123abc"
