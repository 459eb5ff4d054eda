"""Planning context parallelism: a cost model fed by measured rates (model.py, profiles/), the work of
each rank under each layout (work.py), an event simulator of one layer (sim.py) and the planner
(plan.py). Pure host code (numpy, and torch for dtypes): imports nothing of the package but itself and
``distributed.layout`` (pure functions; the balanced layout's placement, priced as the package places it)."""
from .model import Profile, load_profile, shipped
from .plan import Plan, plan_attention
from .sim import Candidate, Problem, Simulator

__all__ = ["Plan", "plan_attention", "Profile", "load_profile", "shipped", "Candidate", "Problem", "Simulator"]
