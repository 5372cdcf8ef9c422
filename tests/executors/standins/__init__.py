"""Local HTTP stand-ins of cloud APIs (Kubernetes, HF Jobs, SageMaker) for the executor tests.

Each stand-in listens on 127.0.0.1, checks the request bodies the real service would reject,
and runs the submitted command as a local subprocess with the environment the job spec asks
for, so a test sees real exit codes, real logs and real status transitions.
"""
