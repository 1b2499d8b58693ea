"""How ``make test``'s workers share the suite (tests/conftest.py): modules whose tests share a
module-scoped fixture stay whole, and the longest units go first."""

from types import SimpleNamespace

from tests import conftest


def test_modules_with_a_module_scoped_fixture_stay_whole_and_others_split_by_test():
    shared = conftest.modules_sharing_fixtures()
    assert {"tests/test_volunteer_from_zero.py", "tests/test_web_browser.py"} <= shared
    assert "tests/test_swarm.py" not in shared  # each of its tests starts its own swarm
    assert conftest.work_unit("tests/test_web_browser.py::test_x", shared) == "tests/test_web_browser.py"
    assert conftest.work_unit("tests/test_swarm.py::test_x", shared) == "tests/test_swarm.py::test_x"


def test_the_longest_units_go_first_a_whole_module_weighing_its_tests(monkeypatch, tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text('{"tests/test_b.py::long": 90, "tests/test_m.py::one": 40, "tests/test_m.py::two": 40}')
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    monkeypatch.setattr(conftest, "modules_sharing_fixtures", lambda: {"tests/test_m.py"})
    names = ["tests/test_a.py::quick", "tests/test_m.py::one", "tests/test_b.py::long", "tests/test_m.py::two",
             "tests/test_a.py::unknown"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    conftest.order_longest_first(items)
    # test_m.py as a unit weighs 80 s, after the 90 s test; unknown tests count 1 s, in their order.
    assert [i.nodeid for i in items] == ["tests/test_b.py::long", "tests/test_m.py::one", "tests/test_m.py::two",
                                         "tests/test_a.py::quick", "tests/test_a.py::unknown"]
