"""The asyncio I/O side of the producer: the driver that runs ``core`` plans on a
``redis.asyncio.Redis``, and the pub/sub subscriber with its reader task."""
