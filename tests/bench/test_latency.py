"""bench/latency.py's table (the measurements themselves need a CUDA device)."""

from bench.latency import markdown


def test_markdown_has_one_row_per_measurement_and_names_failures():
    rows = [dict(op="causal_conv1d", case="T2048-seqs8", impl="ours", host_us=97.7, gpu_us=37.04, events=2.0,
                 bench_us=72.6),
            dict(op="ssd_scan", case="T2048-seqs1", impl="vllm", host_us=586.1, error="RuntimeError: no profiler")]
    table = markdown(rows, "title").splitlines()
    assert table[0] == "title"
    assert table[2].count("|") == table[3].count("|") == table[4].count("|") == table[5].count("|") == 9
    assert table[4] == "| causal_conv1d | T2048-seqs8 | ours | 97.7 | 37.0 | 2.0 | 72.6 |  |"
    assert table[5] == "| ssd_scan | T2048-seqs1 | vllm | 586.1 | nan | nan | nan | RuntimeError: no profiler |"
