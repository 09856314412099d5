from .octree_dfs import DfsOctree

__all__ = ["DfsOctree"]
