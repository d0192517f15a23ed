"""`hubchain`, the default eviction policy (registered as "hubchain").

policy.py    HubChainPolicy: the rules, their constants, the four orders
chain.py     its prefix-chain base: a store never breaks the chain it reads
learning.py  the learned shift: sampled reuse distances, the shadow LRU
loops.py     the hot loops over the orders, in Python; the module
             _hubchain_loops is their C twin (built by setup.py; optional):
             _hubchain_loops.c its method table and init, _hubchain_loops.h
             the shared helpers, _hubchain_loops_{orders,merge,prefix,
             learning}.c the loops by concern

Nothing is imported here: the registry loads policy.py on first use.
"""
