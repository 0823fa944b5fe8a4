"""bench/memory_floor.py's arithmetic (the timing itself runs on the H200)."""
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import memory_floor  # noqa: E402


def test_forward_moves_q_k_v_in_and_o_out():
    # short at D = 128: 278,528 tokens x 16 heads x 128 x 2 bytes = 1.14 GB a tensor, four of them.
    assert memory_floor.forward_bytes(278_528, 16, 128, 2) == 4 * 278_528 * 16 * 128 * 2
    assert memory_floor.forward_bytes(0, 16, 128, 2) == 0


def test_best_ratio_is_the_peer_time_over_the_floor():
    assert memory_floor.best_ratio(2.4, 1.2) == 2.0
    assert memory_floor.best_ratio(1.0, 2.0) == 0.5
