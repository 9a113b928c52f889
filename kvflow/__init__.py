"""kvflow: LLM inference serving as an event-sourced streaming pipeline on Kafka."""

__version__ = "0.1.0"
