"""Decide: a plan from a profile and a budget (plan, cost model, solver). Pure functions of the
vocabulary and ``measure/model_profile.py``; nothing here runs a model."""
