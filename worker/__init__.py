"""The worker service (Redis intake, publishing, recovery) and, in ``engine``, the inference core.

Importing this package does not import torch; the modules that need it import it themselves.
"""
