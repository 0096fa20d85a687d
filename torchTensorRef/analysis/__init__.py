"""Reading what the manager did: traces, the offline reference pager, op costs, the GPU
table and the timeline model that predicts a trace on a GPU.

May import :mod:`..core` only: these are pure models of recorded data, so the manager can
record into them without a circle. Running a program to record it is the command line's.
"""
