from starling.common.text import few


def test_a_few_peers_are_all_named_and_many_are_counted():
    assert few([]) == "[]"
    assert few(["a", "b"]) == "[a, b]"
    assert few(f"p{i}" for i in range(8)) == "[p0, p1, p2, p3, p4, p5, p6, p7]"
    line = few([f"p{i}" for i in range(1000)])
    assert line == "[p0, p1, p2, p3, p4, p5, p6, p7, and 992 more]"
    assert few(range(5), shown=2) == "[0, 1, and 3 more]"
