"""Adaptive tensor parallelism: generation widens its tp groups mid-decode when that pays."""
