"""The implementation of :mod:`ginger`. Private: its modules and names may change; the API is
what :mod:`ginger`, :mod:`ginger.fisher` and :mod:`ginger.sharding` export."""
