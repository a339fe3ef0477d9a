"""Tests of the training step: layouts that must train identically, and the NaN/skip guard."""
