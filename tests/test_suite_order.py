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


def test_tests_marked_swarm_are_found_in_the_source_alone_or_in_a_modules_marks(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n@pytest.mark.flaky(reruns=1)\n@pytest.mark.swarm\ndef test_run(): pass\n\n"
        "@pytest.mark.slow\ndef test_other(): pass\n\nclass Helper:\n    @pytest.mark.swarm\n    def method(self): pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.swarm()]\n")
    (tmp_path / "test_c.py").write_text("import pytest\npytestmark = pytest.mark.slow\n")
    assert conftest.tests_marked_swarm(tmp_path) == {f"{tmp_path.name}/test_a.py::test_run",
                                                     f"{tmp_path.name}/test_b.py"}
    # The suite's own: the runs whose checks failed when two swarms shared the cores.
    marked = conftest.tests_marked_swarm()
    for name in ("tests/test_swarm.py::test_a_storm_of_newcomers_spreads_over_the_donors_and_all_contribute_at_once",
                 "tests/test_round_booking.py::test_a_swarm_whose_steps_outlast_matchmaking_meets_in_one_group_"
                 "and_stays_one_model",
                 "tests/test_diloco.py::test_overlapped_outer_rounds_agree_and_centered_clip_holds_off_a_scaling_attacker"):
        assert name in marked


def test_the_swarm_lane_is_one_unit_and_goes_first_however_long_the_others(monkeypatch, tmp_path):
    durations = tmp_path / "durations.json"
    durations.write_text('{"tests/test_b.py::long": 900, "tests/test_s.py::one": 40, "tests/test_s.py::two[x]": 40}')
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    monkeypatch.setattr(conftest, "modules_sharing_fixtures", lambda: set())
    swarm = {"tests/test_s.py::one", "tests/test_s.py::two", "tests/test_m.py"}
    monkeypatch.setattr(conftest, "tests_marked_swarm", lambda: swarm)
    assert conftest.work_unit("tests/test_s.py::two[x]", set(), swarm) == conftest.SWARM_LANE
    assert conftest.work_unit("tests/test_m.py::anything", set(), swarm) == conftest.SWARM_LANE
    assert conftest.work_unit("tests/test_s.py::three", set(), swarm) == "tests/test_s.py::three"
    names = ["tests/test_a.py::quick", "tests/test_s.py::one", "tests/test_b.py::long", "tests/test_m.py::m",
             "tests/test_s.py::two[x]"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    conftest.order_longest_first(items)
    assert [i.nodeid for i in items] == ["tests/test_s.py::one", "tests/test_m.py::m", "tests/test_s.py::two[x]",
                                         "tests/test_b.py::long", "tests/test_a.py::quick"]


class FakeWorker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down, self.sent = False, []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def test_the_worker_on_the_swarm_lane_takes_nothing_else_until_its_last_lane_test(monkeypatch):
    monkeypatch.setattr(conftest, "modules_sharing_fixtures", lambda: set())
    monkeypatch.setattr(conftest, "tests_marked_swarm", lambda: {"tests/test_s.py"})
    options = {"dist": "load", "tx": ["2*popen"]}
    config = SimpleNamespace(getvalue=options.get, option=SimpleNamespace(loadscopereorder=True))
    scheduler = conftest.pytest_xdist_make_scheduler(config, SimpleNamespace(loadscopesched=lambda *a: None))
    collection = ["tests/test_s.py::one", "tests/test_s.py::two", "tests/test_s.py::three",
                  "tests/test_a.py::a", "tests/test_a.py::b", "tests/test_a.py::c", "tests/test_a.py::d"]
    lane, other = FakeWorker("gw0"), FakeWorker("gw1")
    for worker in (lane, other):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    assert lane.sent == [0, 1, 2], "the lane whole, to the first worker"
    assert other.sent == [3, 4], "one test ahead: a worker holds its last test until it knows the next"
    scheduler.mark_test_complete(lane, 0)
    assert lane.sent == [0, 1, 2]
    scheduler.mark_test_complete(other, 3)
    assert other.sent == [3, 4, 5]
    scheduler.mark_test_complete(lane, 1)  # the lane's last test starts: the next unit may come
    assert lane.sent == [0, 1, 2, 6]
    assert not scheduler.workqueue
