"""Renderers: one API's answer in its wire shape, for the turn pipeline (server/serving/pipeline.py)."""
