

@pytest.mark.skipif(testbed.unavailable_reason() is None, reason="the testbed can be built here, so the benchmark runs")
def test_slowlink_without_a_testbed_says_why_in_one_line():
    proc = run_cli("slowlink", module="jaxdp.bench")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"jaxdp.bench: slowlink: {testbed.unavailable_reason()}"
