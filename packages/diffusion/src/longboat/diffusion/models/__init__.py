"""Diffusion transformer families (one folder each, exposing ``FAMILY``; found by core's
registry through ``Stack.families_package``), ``common/`` for what they share and
``registry.py`` for the diffusion ``Family`` type."""
