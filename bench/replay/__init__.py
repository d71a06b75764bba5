"""Trace replay: real request traces through pdserve's routing policies in a simulated P/D cluster."""
