"""``cats train data`` (self-distillation data), ``cats train features`` (final features for feature adapters) and
``cats train adapter`` (adapter training)."""

from __future__ import annotations


def add_train_parser(commands) -> None:
    from cats.train.data import add_data_parser, add_features_parser
    from cats.train.trainer import add_adapter_parser

    train = commands.add_parser("train", help="make training data and train draft / shallow adapters")
    steps = train.add_subparsers(dest="train_command", required=True)
    add_data_parser(steps)
    add_features_parser(steps)
    add_adapter_parser(steps)
