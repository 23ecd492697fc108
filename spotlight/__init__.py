"""Spotlight: a compact Llama-family inference engine with hashed sparse decode attention.

Kept import-light: submodules load torch and transformers only when used.
"""
