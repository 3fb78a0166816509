"""Serving on Ray Serve (`skillpool serve --replicas N`): an ingress deployment running today's FastAPI app and an
engine deployment of N replicas, each request sent by Ray Serve's model multiplexing to the replica that holds its
mix's heaviest skill. Imported only when --replicas is given: Ray is the optional `cluster` extra.

- `launch.py`: the flags' checks, the import guard, a local or remote Ray, the deploy and its shutdown;
- `deployments.py`: the two deployments and the application builder a KubeRay RayService names;
- `remote_engine.py`: the engine contract at the ingress, over the engine deployment's handle;
- `replica.py`: what one engine replica does: resolve skills from the store, stream, follow the pool;
- `hub.py`: one named actor through which every engine replica follows the skill pool and confirms changes.
"""
