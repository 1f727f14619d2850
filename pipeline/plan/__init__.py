"""`snowcat plan`: memory per device, step time, node-hours and charge of a run before it is
submitted, checked against the site; the compute-time proposal; layout search; plan against a
finished run (docs/planning.md).

Modules, one job each: `model` (the architecture a stage trains), `memory`, `timing`, `sitecheck`,
`budget` (the remaining allocation the site's tool reports), `core` (the plan of a run), `report`,
`proposal`, `search`, `compare`, `command` (the CLI).
Torch-free: it runs on a login node.
"""

from .core import make_plan
from .report import summary, text

__all__ = ["make_plan", "summary", "text"]
