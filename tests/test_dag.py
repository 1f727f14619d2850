"""Stage DAG: order, fan-out units, and the errors for cycles and dangling needs."""

import pytest

from snowcat.pipeline import config, dag
from snowcat.pipeline.errors import UserError
from tests.conftest import DEMO

TWO = ["stages.b.kind=tasks", "stages.b.needs=[tasks]", "stages.c.kind=tasks", "stages.c.needs=[b,tasks]"]


def test_topological_order_follows_needs():
    d = dag.build(
        config.load(DEMO, ["stages.c.kind=tasks", "stages.c.needs=[b]", "stages.b.kind=tasks", "stages.b.needs=[tasks]"])
    )
    order = [n for n in d.order if n in ("tasks", "b", "c")]
    assert order == ["tasks", "b", "c"]
    for node in d:
        assert all(d.order.index(need) < d.order.index(node.name) for need in node.needs)
    assert {"b", "c", "sft", "scan"} <= d.downstream("tasks")


def test_fan_out_is_a_cartesian_product():
    fan_out = ["stages.probe.fan_out.temperature=[0.5,1.0]", "stages.probe.fan_out.replica=[x,y,z]"]
    d = dag.build(config.load(DEMO, [*fan_out, "stages.select.probe='probe[0]'"]))  # select reads one unit
    node = d["probe"]
    assert len(node.units) == 6
    assert node.items[0] == {"temperature": 0.5, "replica": "x"} and node.items[5] == {"temperature": 1.0, "replica": "z"}
    assert [u.key for u in node.units][:2] == ["probe[0]", "probe[1]"]


def test_cycle_is_reported_with_its_path():
    with pytest.raises(UserError, match=r"cycle in needs: (b -> c -> b|c -> b -> c)"):
        dag.build(config.load(DEMO, ["stages.b.kind=tasks", "stages.b.needs=[c]", "stages.c.kind=tasks", "stages.c.needs=[b]"]))


def test_dangling_need():
    with pytest.raises(UserError, match=r"stages\.tasks\.needs: unknown stage 'ghost'"):
        dag.build(config.load(DEMO, ["stages.tasks.needs=[ghost]"]))


def test_empty_fan_out_list():
    with pytest.raises(UserError, match=r"stages\.tasks\.fan_out\.x"):
        dag.build(config.load(DEMO, ["stages.tasks.fan_out.x=[]"]))
