"""The write-back gate: asks while a prefill reuses what decodes wrote back to it."""

from __future__ import annotations

from router.pd.write_back import WriteBack, WriteBackGate

P = "http://prefill"


def serve(gate: WriteBackGate, requests: int, reused_if_written: int) -> list[str]:
    """Requests on P; each reuses `reused_if_written` tokens when the one before wrote back
    (a session's next turn holding the last answer)."""
    decisions, wrote = [], False
    for _ in range(requests):
        decision = gate.ask(P)
        gate.observe(P, decision != "skipped", reused_if_written if wrote else 0)
        wrote = decision != "skipped"
        decisions.append(decision)
    return decisions


def test_the_gate_closes_on_no_reuse_and_reopens_when_answers_are_reused() -> None:
    gate = WriteBackGate()
    first = serve(gate, 200, reused_if_written=0)
    assert first[:32] == ["asked"] * 32  # the warm-up: every request writes back
    assert first[32:40] == ["skipped"] * 7 + ["explored"]
    assert first.count("asked") == 32 and gate.reuse_per_write_back(P) == 0.0
    later = serve(gate, 400, reused_if_written=200)  # answers start being reused
    assert later[-100:] == ["asked"] * 100
    reuse = gate.reuse_per_write_back(P)
    assert reuse is not None and reuse > 100


def test_reuse_just_below_the_bar_keeps_it_closed() -> None:
    gate = WriteBackGate(min_reused_tokens=16)
    decisions = serve(gate, 600, reused_if_written=15)
    assert decisions[-80:].count("skipped") == 70  # 7 of 8 once the yield is known


def test_an_unmeasured_prefill_and_always_mode_always_write_back() -> None:
    gate = WriteBackGate()
    for _ in range(100):
        assert gate.ask(P) == "asked"
        gate.observe(P, True, None)  # a real SGLang prefill reports no written-back count
    assert gate.reuse_per_write_back(P) is None
    always = WriteBackGate(WriteBack.ALWAYS)
    assert set(serve(always, 100, reused_if_written=0)) == {"asked"}
