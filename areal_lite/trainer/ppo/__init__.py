"""The PPO trainer's parts, as AReaL 1.0.4's `areal.trainer.ppo`: `actor.PPOActor`, the policy that a training step
updates and that publishes its weights to the inference servers.
"""
