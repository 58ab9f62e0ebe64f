"""The runtime. This folder's top holds the engine boundary: `Engine` (engine.py), the request front end
and its parts (frontend.py, request_builder.py, prepare_workers.py, delivery.py, branches.py), the
typed messages (messages.py), options, sampling parameters, the scheduler client, images, statistics;
below it scheduler/, memory/, execution/, distributed/, models/, layers/ and tokenizer/."""
