"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, and the forward-only evaluation
schedule of each) as pure data, with a simulator that checks them and a timeline drawer
(``schedules.draw``)."""
from fxmegatron.schedules.actions import Action, Schedule, ScheduleError
from fxmegatron.schedules.generate import forward_only, gpipe, interleaved_1f1b, make_schedule, one_f_one_b
from fxmegatron.schedules.simulate import SimResult, simulate

__all__ = ["Action", "Schedule", "ScheduleError", "forward_only", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "make_schedule", "simulate", "SimResult"]
