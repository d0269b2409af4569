"""The tasks relaunch ships: the digits default and the language model. They are also templates a user
copies out of the project, so they import relaunch by its absolute name (tests/test_house.py)."""
