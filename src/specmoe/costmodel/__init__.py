"""The performance model, a side library: hardware profiles (data), model shapes, the
routing and acceptance model, the per-policy cost model and the planner. Predictions
only: it imports nothing of specmoe but the base layer, and no torch."""

from .cost_model import Scenario, StepEstimate, estimate, roofline
from .hardware import HardwareProfile, list_profiles, load_profile
from .planner import Plan, plan
from .routing import RoutingModel, tokens_per_step
from .shapes import ModelShape, load_shape, shape_from_config, shape_of

__all__ = [
    "HardwareProfile", "ModelShape", "Plan", "RoutingModel", "Scenario", "StepEstimate", "estimate",
    "list_profiles", "load_profile", "load_shape", "plan", "roofline", "shape_from_config", "shape_of",
    "tokens_per_step",
]
