"""Performance model: hardware profiles, model shapes, routing/acceptance models, the
per-policy cost model, engine traces, the simulator (`specmoe simulate`), the planner
(`--policy auto`) and calibration (`specmoe calibrate`)."""

from .cost_model import Scenario, StepEstimate, estimate, roofline
from .hardware import HardwareProfile, list_profiles, load_profile
from .planner import Plan, plan
from .routing import RoutingModel, tokens_per_step
from .shapes import ModelShape, load_shape, shape_from_config
from .trace import LayerRouting, StepRecord, TraceWriter, read_trace

__all__ = [
    "HardwareProfile", "LayerRouting", "ModelShape", "Plan", "RoutingModel", "Scenario", "StepEstimate",
    "StepRecord", "TraceWriter", "estimate", "list_profiles", "load_profile", "load_shape", "plan",
    "read_trace", "roofline", "shape_from_config", "tokens_per_step",
]
