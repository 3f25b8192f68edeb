"""The implementation of :mod:`ginger`: private, imported only through the public modules."""
