"""Trainers, as AReaL 1.0.4's `areal.trainer`: `ppo.actor.PPOActor` computes log-probabilities, advantages and the
PPO update on one process (CPU or one GPU), with the methods and call order of AReaL's actor.
"""
